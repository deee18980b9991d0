module jobrunner.test/pause

go 1.26.0

from jobrunner.cli.main import main

main()

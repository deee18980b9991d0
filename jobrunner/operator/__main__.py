from jobrunner.operator.main import main

main()

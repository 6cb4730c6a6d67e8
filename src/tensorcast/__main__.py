from tensorcast.cli import main

main()

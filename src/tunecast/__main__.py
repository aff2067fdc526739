from tunecast.cli import main

main()

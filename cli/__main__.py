from rankkit.cli import main

main()

from scaletool.cli import main

main()

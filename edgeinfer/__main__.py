"""`python -m edgeinfer` runs the command line."""

from edgeinfer.cli.app import main

main()

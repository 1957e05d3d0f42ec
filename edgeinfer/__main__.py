"""`python -m edgeinfer` runs the command line."""

from edgeinfer.cli import main

main()

"""`python -m ipward`: the command line, as the `ipward` executable runs it."""

from ipward.cmd.cli import main

main()

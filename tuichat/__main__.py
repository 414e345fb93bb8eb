"""`python -m tuichat` is the `tuichat` command."""

from tuichat.cli import main

main()

"""`python -m launcher` is the same as the `rally` command."""

from launcher.cli import main

if __name__ == "__main__":
    main()

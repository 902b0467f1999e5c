"""`python -m rally` is the same as the `rally` command."""

from rally.launcher.entry import main

if __name__ == "__main__":
    main()

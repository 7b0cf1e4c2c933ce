"""The ``omni`` command line. Importing it is cheap: commands import heavy libraries when they run."""

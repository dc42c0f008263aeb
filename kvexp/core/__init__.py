"""The bottom layer: typed configuration, kvexp's folders, the machine, the version. Imports nothing
else of kvexp."""

__version__ = "0.1.0"

from kvexp.cli import entry

entry()

"""One module per ``kvstate`` command; see kvstate.commands.cli."""

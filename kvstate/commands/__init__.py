"""One module per ``kvstate`` command; see kvstate.cli."""

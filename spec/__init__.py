"""The normative transition tables, shipped inside kvstate as the package kvstate.tables."""

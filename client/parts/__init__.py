"""One version from many trainer ranks: a Part, its agreement, group, push and verify."""

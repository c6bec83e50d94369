"""Host sides of the package's operations, one module per op (and per GPU family)."""

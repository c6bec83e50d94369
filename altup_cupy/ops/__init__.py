"""The ops: one module per op (validation, custom-operator registration, public function) and
one `*_versions` module per op (its registry of kernel versions and their launch plans).

Importing this package registers the torch custom operators `torch.ops.altup_cupy.*`; it needs
no GPU and compiles nothing.
"""

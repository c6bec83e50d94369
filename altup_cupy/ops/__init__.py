"""The ops: one module per op (validation, custom-operator registration, public function) and
one `*_versions` module per op (its registry of kernel versions and their launch plans). Gemma
3n's AltUp steps are one family of operators, `gemma3n_altup` (made differentiable and public by
`altup_cupy.torch`), with one registry, `gemma3n_altup_versions`.

Importing this package registers the torch custom operators `torch.ops.altup_cupy.*`; it needs
no GPU and compiles nothing.
"""

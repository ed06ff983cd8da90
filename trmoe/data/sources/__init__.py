"""The built-in data sources: one module each, defining `VARIANT` (trmoe.data.variant.DataSourceVariant).

A module here imports at module level only the standard library and torch-free trmoe modules (the config
layer reads these declarations without loading torch); its builder imports the rest inside its function.
"""

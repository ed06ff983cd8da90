import trmoe_dependency_that_is_not_installed  # noqa: F401

VARIANT = None

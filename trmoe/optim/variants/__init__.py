"""The built-in optimizers, one module each (`VARIANT = OptimizerVariant(...)`, trmoe.config.optimizers).

Adding one is adding a module here: its options, builder, rules, memory estimate and docs row live in it.
A module imports at module level only the standard library, trmoe.errors, trmoe.registry and
trmoe.config.optimizers (the config layer reads this package without torch; tests/test_imports.py checks
it); torch and the update rules' code are imported inside its functions."""

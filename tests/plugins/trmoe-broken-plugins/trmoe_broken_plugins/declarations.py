from trmoe.config.optimizers import OptimizerVariant
from trmoe.data.variant import DataSourceVariant

BAD_OPTIONS = OptimizerVariant(
    name="bad_options", doc="", build=lambda *a: None, state_bytes=lambda e, m: (0, ""), options=dict
)
NOT_A_STRATEGY = {"build": None}
NO_BUILDER = DataSourceVariant(name="no_builder", build=None, doc="")

from trmoe.config.optimizers import OptimizerVariant
from trmoe.data.variant import DataSourceVariant

BAD_OPTIONS = OptimizerVariant(
    name="bad_options", doc="", build=lambda *a: None, state_bytes=0, state="", options=dict
)
NOT_A_STRATEGY = {"build": None}
NO_BUILDER = DataSourceVariant(name="no_builder", build=None, doc="")

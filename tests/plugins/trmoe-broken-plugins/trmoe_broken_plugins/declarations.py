from dataclasses import dataclass, field

from trmoe.config.optimizers import OptimizerVariant
from trmoe.data.variant import DataSourceVariant

BAD_OPTIONS = OptimizerVariant(
    name="bad_options", doc="", build=lambda *a: None, state_bytes=0, state="", options=dict
)
NOT_A_STRATEGY = {"build": None}
NO_BUILDER = DataSourceVariant(name="no_builder", build=None, doc="")


@dataclass
class SetOptions:
    bad_types_ids: set = field(default_factory=set)  # a type no config key can hold


BAD_TYPES = OptimizerVariant(
    name="bad_types", doc="", build=lambda *a: None, state_bytes=0, state="", options=SetOptions
)

from ipward_lab.bench.run import *  # noqa: F403
from ipward_lab.bench.run import __all__ as __all__

"""The old import path of `dflash_dist.models.variants.dspark.heads` (before each variant became one folder, issue 45): the same
module object under both names, so imports, patches and pickles written against the old path keep working."""
import sys

from dflash_dist.models.variants.dspark import heads as _moved

sys.modules[__name__] = _moved

"""certblocks: residual blocks with a stability certificate.

Decide before training, for a given depth and dtype, whether the forward state
or the gradient of a residual stack ``X_{k+1} = X_k + dt * v_k(X_k)`` can reach
the largest finite value of the dtype.
"""

from .budget import float_max, jacobian_budget
from .certificate import BlockCertificate, Depths, Failure, StackCertificate, certify_stack
from .exponents import Exponents
from .stack import CertificationError, CertifiedStack, build_stack

__version__ = "0.1.0.dev0"

__all__ = [
    "BlockCertificate",
    "CertificationError",
    "CertifiedStack",
    "Depths",
    "Exponents",
    "Failure",
    "StackCertificate",
    "build_stack",
    "certify_stack",
    "float_max",
    "jacobian_budget",
]

"""`python -m freetoken_verify.cases`: write the bundled cases (`make golden`) or the
real-dimension checkpoint (`--realdims`). Bundled cases are written in the pinned numeric
environment of `freetoken_verify.cases.numerics`, set here before torch is imported."""

import os
import sys

from freetoken_verify.cases.numerics import PINNED

if "--realdims" not in sys.argv:
    os.environ.update(PINNED)

from freetoken_verify.cases.catalogue import main  # noqa: E402  (after the environment)

main()

"""`python -m freetoken_verify.cases`: write the bundled cases (`make golden`) or the
real-dimension checkpoint (`--realdims`)."""

from freetoken_verify.cases.catalogue import main

main()

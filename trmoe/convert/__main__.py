"""`python -m trmoe.convert`: see trmoe.convert."""

import sys

from trmoe.convert import main

sys.exit(main())

import os

import ultrathink  # noqa: F401  (sets the quiet/offline environment for everything the tests import)

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")

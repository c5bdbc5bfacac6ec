import sys

from eaglekit._launcher import main

sys.exit(main())

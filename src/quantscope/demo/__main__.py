"""``python -m quantscope.demo``: the synthetic format table (:mod:`.formats`)."""

from .formats import main

raise SystemExit(main())

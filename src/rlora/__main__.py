from rlora.cli import main

raise SystemExit(main())

from kvstate.commands.cli import main

raise SystemExit(main())

"""One module per subcommand (``masktrl <name>``); ``masktrl.cli`` registers them."""

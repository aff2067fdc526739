"""Other tools' training runs: their configs read into tunecast's (`--from`) and written from it (`tunecast export
axolotl|llamafactory`), and how their steps differ from tunecast's in words (profiles.py). What each runner is
(`runner:`, its defaults and step variants) is config/runner.py's."""

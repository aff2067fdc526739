"""Other tools' training runs: what their steps do differently from tunecast's (`--runner`), and their configs
(`--from`, `tunecast export axolotl|llamafactory`)."""

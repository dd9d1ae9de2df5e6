"""ZeRO stages as policies over the same flat units (see DESIGN.md, "One mechanism"); the
stage's data (``StagePolicy``) lives with the units it describes (zeroshard/units/)."""

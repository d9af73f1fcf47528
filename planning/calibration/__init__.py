"""Published training runs as case files (cases/*.toml, read by case.py) and the step model's parameters fitted on
them, with the leave-one-out error every projected band rests on."""

"""Block stamping: a deep model's repeated blocks captured from two units of each run (``runs``) and the rest
stamped out as checked copies (``repeats``), float attributes that vary block by block tracked (``block_floats``)."""

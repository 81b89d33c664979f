"""User-facing API: Saver, load configuration, options."""

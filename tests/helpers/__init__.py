"""Test helpers shared by the test folders: worker processes, tables, hostile edits, stress trials,
and the small training job that tests run, kill and resume as a child process."""

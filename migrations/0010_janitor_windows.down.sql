DROP TABLE janitor_windows;

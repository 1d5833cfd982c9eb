DROP TABLE dead_replays;

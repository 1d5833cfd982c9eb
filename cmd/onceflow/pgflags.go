package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/url"
	"os"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PostgreSQL connection settings beyond the URL. pgx itself reads sslmode,
// sslrootcert, sslcert, sslkey and pool_max_conns from the URL, and the
// password from the URL, PGPASSWORD, or the passfile (PGPASSFILE, default
// ~/.pgpass), in that order.

func (c *common) registerPG(fs *flag.FlagSet) {
	fs.StringVar(&c.passwordFile, "database-password-file", env("ONCEFLOW_DATABASE_PASSWORD_FILE", ""), "file holding the database password (one trailing newline ignored), e.g. a mounted secret; overrides the URL's, PGPASSWORD and .pgpass (env ONCEFLOW_DATABASE_PASSWORD_FILE)")
	fs.IntVar(&c.poolSize, "database-pool-size", envInt("ONCEFLOW_DATABASE_POOL_SIZE", 0), "most connections the pool opens; 0: the URL's pool_max_conns, else pgx's default (the greater of 4 and the CPU count) (env ONCEFLOW_DATABASE_POOL_SIZE)")
}

// applyPG applies the password file and pool size to cfg.
func (c *common) applyPG(cfg *pgxpool.Config) error {
	if c.passwordFile != "" {
		pw, err := readPasswordFile(c.passwordFile)
		if err != nil {
			return err
		}
		cfg.ConnConfig.Password = pw
		// Read again for every new connection: a password rotated in place
		// (a mounted secret) is used without a restart, once the pool
		// replaces its connections (or the old ones are ended).
		file, before := c.passwordFile, cfg.BeforeConnect
		cfg.BeforeConnect = func(ctx context.Context, cc *pgx.ConnConfig) error {
			if before != nil {
				if err := before(ctx, cc); err != nil {
					return err
				}
			}
			pw, err := readPasswordFile(file)
			if err != nil {
				return err
			}
			cc.Password = pw
			return nil
		}
	}
	switch {
	case c.poolSize < 0 || c.poolSize > 10000:
		return fmt.Errorf("--database-pool-size: %d is not between 0 and 10000", c.poolSize)
	case c.poolSize > 0:
		cfg.MaxConns = int32(c.poolSize)
		if cfg.MinConns > cfg.MaxConns {
			cfg.MinConns = cfg.MaxConns
		}
	}
	return nil
}

// readPasswordFile reads --database-password-file: one trailing newline
// (and a carriage return before it) ignored, empty refused.
func readPasswordFile(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("--database-password-file: %w", err)
	}
	pw := strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
	if pw == "" {
		return "", fmt.Errorf("--database-password-file: %s is empty", path)
	}
	return pw, nil
}

// parseURLError describes why --database-url does not parse without
// quoting it: pgx's error quotes the string with its password masked only
// as far as pgx could parse it ("password='se cret" came out as
// "password=xxxxx cret").
func parseURLError(err error) error {
	var pe *pgconn.ParseConfigError
	if !errors.As(err, &pe) {
		return errors.New("--database-url: cannot parse it")
	}
	// Error() is "cannot parse `<string>`: <reason>"; the reason holds no
	// backquote of its own.
	msg := pe.Error()
	if i := strings.LastIndex(msg, "`: "); i >= 0 {
		reason := msg[i+len("`: "):]
		// net/url's errors quote the whole URL, password and all.
		if ue := (*url.Error)(nil); errors.As(pe, &ue) {
			reason = strings.ReplaceAll(reason, ue.Error(), ue.Err.Error())
		}
		return fmt.Errorf("--database-url: cannot parse it: %s", reason)
	}
	return errors.New("--database-url: cannot parse it")
}

package kafkatest

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Broker is a real Apache Kafka broker of one test's own, run by
// scripts/kafka.sh with a state dir of its own (own ports, data and
// certificates), so the test can SIGKILL, stop and restart it without
// touching the broker other tests share. Its addresses stay the same across
// restarts.
type Broker struct {
	Kafka
	Env    RealBrokerEnv
	script string
	state  string
}

// NewBroker starts a dedicated broker, stopped and deleted when the test
// ends. It needs the real-broker setup of `make test-kafka`
// (ONCEFLOW_TEST_KAFKA_BROKERS and ONCEFLOW_TEST_KAFKA_SCRIPT); without it
// the test is skipped with that reason: kfake cannot be killed as a process.
func NewBroker(t testing.TB) *Broker {
	t.Helper()
	shared := RealEnv(t)
	b := &Broker{script: shared.Script, state: t.TempDir()}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("kafkatest: broker log tail (%s):\n%s", b.state, b.LogTail(60))
		}
		b.run(t, 3*time.Minute, "clean")
	})
	b.Start(t)
	return b
}

// Start starts the broker (again) and waits until it answers.
func (b *Broker) Start(t testing.TB) {
	t.Helper()
	out := b.run(t, 6*time.Minute, "start")
	env := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		name, value, ok := strings.Cut(strings.TrimPrefix(sc.Text(), "export "), "=")
		if ok {
			env[name] = value
		}
	}
	b.Env = RealBrokerEnv{
		Brokers:        env["ONCEFLOW_TEST_KAFKA_BROKERS"],
		SSLBrokers:     env["ONCEFLOW_TEST_KAFKA_SSL_BROKERS"],
		SASLBrokers:    env["ONCEFLOW_TEST_KAFKA_SASL_BROKERS"],
		CAFile:         env["ONCEFLOW_TEST_KAFKA_CA_FILE"],
		ClientCertFile: env["ONCEFLOW_TEST_KAFKA_CLIENT_CERT_FILE"],
		ClientKeyFile:  env["ONCEFLOW_TEST_KAFKA_CLIENT_KEY_FILE"],
		ServerName:     env["ONCEFLOW_TEST_KAFKA_SERVER_NAME"],
		SASLUser:       env["ONCEFLOW_TEST_KAFKA_SASL_USER"],
		SASLPassword:   env["ONCEFLOW_TEST_KAFKA_SASL_PASSWORD"],
		Script:         b.script,
	}
	if b.Env.Brokers == "" {
		t.Fatalf("kafkatest: %s start printed no ONCEFLOW_TEST_KAFKA_BROKERS:\n%s", b.script, out)
	}
	b.Kafka = Kafka{Brokers: []string{b.Env.Brokers}}
}

// Kill SIGKILLs the broker: no shutdown, no flush.
func (b *Broker) Kill(t testing.TB) { t.Helper(); b.run(t, time.Minute, "kill") }

// Stop stops the broker cleanly (SIGTERM, then waits).
func (b *Broker) Stop(t testing.TB) { t.Helper(); b.run(t, 2*time.Minute, "stop") }

// LogTail returns the last n lines of the broker's log.
func (b *Broker) LogTail(n int) string {
	data, _ := os.ReadFile(filepath.Join(b.state, "logs", "server.log"))
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func (b *Broker) run(t testing.TB, timeout time.Duration, args ...string) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, b.script, append([]string{"--state", b.state}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("kafkatest: %s %s: %v\n%s", filepath.Base(b.script), strings.Join(args, " "), err, stderr.String())
	}
	return out
}

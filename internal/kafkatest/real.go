package kafkatest

import (
	"os"
	"testing"
)

// RealBrokerEnv is the env file of scripts/kafka.sh: the addresses of the
// real broker's three listeners, its CA, a client certificate and the SASL
// user (see the script's header for the variable names).
type RealBrokerEnv struct {
	Brokers        string // PLAINTEXT host:port (ONCEFLOW_TEST_KAFKA_BROKERS)
	SSLBrokers     string // SSL host:port (ONCEFLOW_TEST_KAFKA_SSL_BROKERS)
	SASLBrokers    string // SASL_SSL host:port (ONCEFLOW_TEST_KAFKA_SASL_BROKERS)
	CAFile         string // ONCEFLOW_TEST_KAFKA_CA_FILE
	ClientCertFile string // ONCEFLOW_TEST_KAFKA_CLIENT_CERT_FILE
	ClientKeyFile  string // ONCEFLOW_TEST_KAFKA_CLIENT_KEY_FILE
	ServerName     string // ONCEFLOW_TEST_KAFKA_SERVER_NAME
	SASLUser       string // ONCEFLOW_TEST_KAFKA_SASL_USER
	SASLPassword   string // ONCEFLOW_TEST_KAFKA_SASL_PASSWORD
	Script         string // ONCEFLOW_TEST_KAFKA_SCRIPT
}

// Real reports whether the tests run against a real broker
// (ONCEFLOW_TEST_KAFKA_BROKERS is set).
func Real() bool { return os.Getenv("ONCEFLOW_TEST_KAFKA_BROKERS") != "" }

// RealEnv returns the real broker's env. Without ONCEFLOW_TEST_KAFKA_BROKERS
// the test is skipped with the reason (kfake has no TLS or SASL listeners;
// `make test-kafka` sets the variables); with it, a missing variable fails
// the test.
func RealEnv(t testing.TB) RealBrokerEnv {
	t.Helper()
	if !Real() {
		t.Skip("kafkatest: needs the real broker of scripts/kafka.sh (make test-kafka); kfake has no TLS or SASL listeners")
	}
	get := func(name string) string {
		v := os.Getenv(name)
		if v == "" {
			t.Fatalf("kafkatest: ONCEFLOW_TEST_KAFKA_BROKERS is set but %s is not: source the env file scripts/kafka.sh writes", name)
		}
		return v
	}
	return RealBrokerEnv{
		Brokers:        get("ONCEFLOW_TEST_KAFKA_BROKERS"),
		SSLBrokers:     get("ONCEFLOW_TEST_KAFKA_SSL_BROKERS"),
		SASLBrokers:    get("ONCEFLOW_TEST_KAFKA_SASL_BROKERS"),
		CAFile:         get("ONCEFLOW_TEST_KAFKA_CA_FILE"),
		ClientCertFile: get("ONCEFLOW_TEST_KAFKA_CLIENT_CERT_FILE"),
		ClientKeyFile:  get("ONCEFLOW_TEST_KAFKA_CLIENT_KEY_FILE"),
		ServerName:     get("ONCEFLOW_TEST_KAFKA_SERVER_NAME"),
		SASLUser:       get("ONCEFLOW_TEST_KAFKA_SASL_USER"),
		SASLPassword:   get("ONCEFLOW_TEST_KAFKA_SASL_PASSWORD"),
		Script:         get("ONCEFLOW_TEST_KAFKA_SCRIPT"),
	}
}

// Package kafkaconn is the one vocabulary for how onceflow's Kafka clients
// reach the brokers: client id, TLS and SASL. The relay's publishers
// (relay/kgopublisher, relay/kafkagopublisher) and the consumer adapters
// (consumer/kgoconsumer, consumer/kafkagoconsumer) each take a
// kafkaconn.Config in their own Config's Conn field and turn it into their
// client's settings, so one Config reaches a cluster through any of them.
//
// The zero Config is plaintext without authentication. A SASL_SSL cluster
// (Confluent Cloud, Amazon MSK with SCRAM) needs both halves:
//
//	conn := kafkaconn.Config{
//		TLS:  &kafkaconn.TLS{}, // system roots; CAFile for a private CA
//		SASL: &kafkaconn.SASL{Mechanism: kafkaconn.ScramSHA512, Username: "relay", Password: os.Getenv("KAFKA_PASSWORD")},
//	}
//	pub, err := kgopublisher.New(brokers, &kgopublisher.Config{Conn: conn})
//
// Amazon MSK with IAM: SASL{Mechanism: kafkaconn.AWSMSKIAM} over TLS. The
// credentials come from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and
// AWS_SESSION_TOKEN unless SASL.AWSCredentials supplies them (for instance
// from aws-sdk-go-v2's config.LoadDefaultConfig, for web identity or
// instance roles).
//
// Brokers are plain host:port. ParseBrokers understands the Java client's
// listener prefixes (SASL_SSL://host:port) and says which security protocol
// they ask for; the adapters refuse a prefixed address instead of trying to
// resolve it as a host name.
//
// Validate checks a Config without touching the network or files' contents
// beyond reading them; errors name the field (TLS.CertFile, SASL.Username).
// Passwords are never part of an error or of String.
package kafkaconn

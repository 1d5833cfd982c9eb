package kafkatest

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kmsg"
)

// FencedPeer registers a second broker (node id 2, broker role only) with
// this broker's KRaft controller, then SIGKILLs it and waits until the
// controller fences it. A partition assigned to both brokers then has an ISR
// of one: with min.insync.replicas=2 the leader answers every acks=all
// produce with NOT_ENOUGH_REPLICAS, as a partition below its minimum ISR
// does. (On one broker, min.insync.replicas above the replication factor is
// not enough: Kafka caps the minimum at the partition's replica count.)
func (b *Broker) FencedPeer(t testing.TB) int32 {
	t.Helper()
	const id = 2
	props := readProps(t, filepath.Join(b.state, "server.properties"))
	meta := readProps(t, filepath.Join(b.state, "data", "meta.properties"))
	libs := strings.TrimSpace(lastLine(string(b.run(t, 10*time.Minute, "jars"))))
	dir := t.TempDir()
	data := filepath.Join(dir, "data")
	if err := os.MkdirAll(data, 0o755); err != nil {
		t.Fatal(err)
	}
	u := make([]byte, 16)
	_, _ = rand.Read(u)
	writeFile(t, filepath.Join(data, "meta.properties"), fmt.Sprintf("version=1\nnode.id=%d\ncluster.id=%s\ndirectory.id=%s\n",
		id, meta["cluster.id"], base64.RawURLEncoding.EncodeToString(u)))
	addr := freeAddr(t)
	writeFile(t, filepath.Join(dir, "server.properties"), strings.Join([]string{
		"process.roles=broker",
		fmt.Sprintf("node.id=%d", id),
		"controller.quorum.voters=" + props["controller.quorum.voters"],
		"listeners=PLAINTEXT://" + addr,
		"advertised.listeners=PLAINTEXT://" + addr,
		"listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
		"controller.listener.names=CONTROLLER",
		"inter.broker.listener.name=PLAINTEXT",
		"log.dirs=" + data,
		"num.network.threads=1",
		"num.io.threads=1",
		"",
	}, "\n"))
	out, err := os.Create(filepath.Join(dir, "out.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	cmd := exec.Command("java", "-Xmx256m", "-Xms128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
		"-cp", filepath.Join(libs, "*"), "kafka.Kafka", filepath.Join(dir, "server.properties"))
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatalf("kafkatest: start the peer broker: %v", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	kill := func() { _ = cmd.Process.Kill(); <-exited }
	t.Cleanup(kill)
	cl := b.Client(t)
	fenced := func() (bool, bool) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		req := kmsg.NewPtrDescribeClusterRequest()
		req.IncludeFencedBrokers = true
		resp, err := req.RequestWith(ctx, cl)
		if err != nil {
			return false, false
		}
		for _, br := range resp.Brokers {
			if br.NodeID == id {
				return true, br.IsFenced
			}
		}
		return false, false
	}
	wait := func(what string, cond func() bool) {
		deadline := time.Now().Add(3 * time.Minute)
		for !cond() {
			select {
			case <-exited:
				if what == "registered" {
					log, _ := os.ReadFile(filepath.Join(dir, "out.log"))
					t.Fatalf("kafkatest: the peer broker exited before it registered:\n%s", tailLines(string(log), 40))
				}
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("kafkatest: the peer broker was not %s within 3m", what)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	wait("registered", func() bool { ok, f := fenced(); return ok && !f })
	kill()
	wait("fenced", func() bool { ok, f := fenced(); return ok && f })
	return id
}

// CreateTopicOn creates a one-partition topic whose replicas are the given
// brokers (the first one leads) and waits until its leader serves it.
func (k *Kafka) CreateTopicOn(t testing.TB, name string, replicas []int32, configs map[string]*string) {
	t.Helper()
	cl := k.Client(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req := kmsg.NewPtrCreateTopicsRequest()
	req.TimeoutMillis = 30000
	tr := kmsg.NewCreateTopicsRequestTopic()
	tr.Topic, tr.NumPartitions, tr.ReplicationFactor = name, -1, -1
	a := kmsg.NewCreateTopicsRequestTopicReplicaAssignment()
	a.Replicas = replicas
	tr.ReplicaAssignment = append(tr.ReplicaAssignment, a)
	for n, v := range configs {
		c := kmsg.NewCreateTopicsRequestTopicConfig()
		c.Name, c.Value = n, v
		tr.Configs = append(tr.Configs, c)
	}
	req.Topics = append(req.Topics, tr)
	resp, err := req.RequestWith(ctx, cl)
	if err == nil && len(resp.Topics) == 1 && resp.Topics[0].ErrorCode != 0 {
		msg := ""
		if m := resp.Topics[0].ErrorMessage; m != nil {
			msg = *m
		}
		err = fmt.Errorf("error code %d: %s", resp.Topics[0].ErrorCode, msg)
	}
	if err != nil {
		t.Fatalf("kafkatest: create topic %s on %v: %v", name, replicas, err)
	}
	WaitTopicReady(t, k.Admin(t), name, 1)
}

func readProps(t testing.TB, path string) map[string]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatalf("kafkatest: %v", err)
	}
	defer f.Close()
	m := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok && !strings.HasPrefix(k, "#") {
			m[k] = v
		}
	}
	return m
}

func writeFile(t testing.TB, path, s string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
}

func freeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return lines[len(lines)-1]
}

func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

package consumer_test

import (
	"errors"
	"fmt"

	"github.com/onceflow/onceflow/consumer"
)

// A handler returns Permanent for failures that retrying cannot fix: the
// message goes to the dead-letter topic after this one attempt.
func ExamplePermanent() {
	err := consumer.Permanent(errors.New("decode payment: unexpected end of JSON input"))
	fmt.Println(consumer.IsPermanent(err))
	fmt.Println(err)
	// Output:
	// true
	// permanent: decode payment: unexpected end of JSON input
}

// The default message id is the relay's message-id header; a message
// without one is dead-lettered with the reason.
func ExampleHeaderMessageID() {
	id, err := consumer.HeaderMessageID(consumer.Message{Headers: []consumer.Header{{Key: "message-id", Value: []byte("7f1d8a52-5b7e-4a37-9d7c-0d6f1c1f0c11")}}})
	fmt.Println(id, err)
	_, err = consumer.HeaderMessageID(consumer.Message{})
	fmt.Println(errors.Is(err, consumer.ErrNoMessageID), err)
	// Output:
	// 7f1d8a52-5b7e-4a37-9d7c-0d6f1c1f0c11 <nil>
	// true no usable message id: header "message-id" is missing
}

// Package rabbitmq is Conveyor's RabbitMQ adapter: the broker topology, the
// relay's confirming publisher, the worker's consumer and the queue
// inspection of the maintenance leader.
//
// PostgreSQL holds every task; RabbitMQ only delivers. A task.run message
// goes to the direct exchange conveyor.tasks with the task's type as routing
// key and lands in the durable queue conveyor.task.<type>, a classic
// queue, with priorities or without (Queues), or a replicated quorum queue.
// When a relay's batch holds several tasks of one type and priority, it
// packs them into messages of several tasks each (Packed), which go to
// the direct exchange conveyor.packed and land in conveyor.packed.<type>,
// declared alike: the broker's cost of a delivery is then shared by the
// tasks of the message. Only workers declare those queues, for the types
// they run: a message for a type no worker has declared yet is returned to
// the relay, which parks it in PostgreSQL. task.cancel messages are
// broadcast on the fanout exchange conveyor.control to an exclusive queue
// per worker.
//
// Publisher, Consumer and Inspector speak in the types of package outbox.
// Two things of amqp091-go are visible to callers: DeclareExchanges,
// DeclareTaskQueue and DeclareTaskQueueOf take an *amqp.Channel, for code
// that holds its own channel (tests, tools), and the errors returned by Err
// may wrap an *amqp.Error, which errors.As finds.
package rabbitmq

import (
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/conveyorhq/conveyor/internal/task"
)

// The names of the topology.
const (
	// TasksExchange routes task.run messages to their type's queue.
	TasksExchange = "conveyor.tasks"
	// PackedExchange routes packed task.run messages, several tasks of one
	// type each, to their type's packed queue.
	PackedExchange = "conveyor.packed"
	// ControlExchange broadcasts task.cancel messages to every worker.
	ControlExchange = "conveyor.control"
)

// QueueName is the durable queue that holds the task.run messages of a type.
func QueueName(taskType string) string { return "conveyor.task." + taskType }

// PackedQueueName is the durable queue that holds the packed task.run
// messages of a type. It is a queue of its own so that a worker can give
// it a prefetch of its own: one message there is many tasks.
func PackedQueueName(taskType string) string { return "conveyor.packed." + taskType }

// DeclareExchanges declares the exchanges, durable. Declaring is
// idempotent.
func DeclareExchanges(ch *amqp.Channel) error {
	for _, name := range []string{TasksExchange, PackedExchange} {
		if err := ch.ExchangeDeclare(name, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
			return fmt.Errorf("declare exchange %s: %w", name, err)
		}
	}
	if err := ch.ExchangeDeclare(ControlExchange, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %s: %w", ControlExchange, err)
	}
	return nil
}

// QueueType is the kind of queue the workers declare for their types.
type QueueType string

const (
	// Classic queues live on one node and honour the task priorities up
	// to Queues.MaxPriority (all of them by default). The default.
	Classic QueueType = "classic"
	// Quorum queues are replicated over a cluster's nodes (Raft) and
	// survive the loss of a minority of them. RabbitMQ 3.x refuses
	// x-max-priority on them and ignores message priorities; 4.x has two
	// levels, normal (0-4) and high (5 and up). Nor do they support a
	// channel-wide prefetch: each consumer gets the credit (see
	// DialConsumer).
	Quorum QueueType = "quorum"
)

// ParseQueueType reads a queue type as AMQP_QUEUE_TYPE spells it.
func ParseQueueType(s string) (QueueType, error) {
	switch qt := QueueType(s); qt {
	case Classic, Quorum:
		return qt, nil
	}
	return "", fmt.Errorf("unknown queue type %q: must be %q or %q", s, Classic, Quorum)
}

// Queues says how the workers declare their types' queues: the queue type
// and, for classic queues, how many priorities the broker keeps apart.
// Every worker of a type must agree, since a queue keeps the arguments it
// was created with.
type Queues struct {
	Type QueueType
	// MaxPriority is a classic queue's x-max-priority, the highest
	// priority it keeps apart, from 1 to task.MaxPriority: a message of a
	// higher priority counts as of this one. 0 declares queues without
	// priorities, which deliver in publication order and cost the broker
	// less (about a quarter less CPU a task in burn-downs,
	// docs/performance.md). Quorum queues ignore it.
	MaxPriority int
}

// ClassicQueues are classic queues that honour every task priority: the
// default. Neither it nor QuorumQueues is ever changed.
var ClassicQueues = Queues{Type: Classic, MaxPriority: task.MaxPriority}

// QuorumQueues are quorum queues.
var QuorumQueues = Queues{Type: Quorum}

// arguments are the queue arguments a type's queue is declared with.
func (q Queues) arguments() amqp.Table {
	switch {
	case q.Type == Quorum:
		return amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum}
	case q.MaxPriority > 0:
		return amqp.Table{"x-max-priority": int32(q.MaxPriority)}
	}
	return nil
}

// String names the queues as the configuration spells them.
func (q Queues) String() string {
	switch {
	case q.Type == Quorum:
		return string(q.Type)
	case q.MaxPriority == 0:
		return fmt.Sprintf("%s without priorities", q.Type)
	}
	return fmt.Sprintf("%s (max priority %d)", q.Type, q.MaxPriority)
}

// Refused reports whether err is the broker refusing a declaration
// (PRECONDITION_FAILED: the queue or exchange exists with other
// arguments): the broker was reached, and retrying changes nothing until
// the configuration or the queue does.
func Refused(err error) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Code == amqp.PreconditionFailed
}

// DeclareTaskQueue declares a type's durable classic queues, whose
// x-max-priority is task.MaxPriority so that every priority a task may have
// is honoured, and binds them as DeclareTaskQueueOf does. It is
// DeclareTaskQueueOf with ClassicQueues.
func DeclareTaskQueue(ch *amqp.Channel, taskType string) error {
	return DeclareTaskQueueOf(ch, taskType, ClassicQueues)
}

// DeclareTaskQueueOf declares a type's two durable queues as qs says, the
// queue of single messages and the packed queue, and binds them to the
// tasks and packed exchanges with the type as routing key. Workers declare
// the queues of their types before consuming; the relay never declares
// one, so the set of queues is the set of types some worker runs.
// Declaring is idempotent, but RabbitMQ refuses (PRECONDITION_FAILED, which
// also closes ch) to declare a queue that exists with other arguments,
// such as the other type or another maximum priority: the error then says
// so.
func DeclareTaskQueueOf(ch *amqp.Channel, taskType string, qs Queues) error {
	for _, q := range []struct{ name, exchange string }{
		{QueueName(taskType), TasksExchange},
		{PackedQueueName(taskType), PackedExchange},
	} {
		if _, err := ch.QueueDeclare(q.name, true, false, false, false, qs.arguments()); err != nil {
			if Refused(err) {
				return fmt.Errorf("declare queue %s as %s: %w (the queue exists with other arguments: "+
					"check that AMQP_QUEUE_TYPE and AMQP_MAX_PRIORITY are what it was created with, "+
					"or delete it to change them)", q.name, qs, err)
			}
			return fmt.Errorf("declare queue %s: %w", q.name, err)
		}
		if err := ch.QueueBind(q.name, taskType, q.exchange, false, nil); err != nil {
			return fmt.Errorf("bind queue %s: %w", q.name, err)
		}
	}
	return nil
}

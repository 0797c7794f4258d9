// Package rabbitmq is Conveyor's RabbitMQ adapter: the broker topology, the
// relay's confirming publisher, the worker's consumer and the queue
// inspection of the maintenance leader.
//
// PostgreSQL holds every task; RabbitMQ only delivers. A task.run message
// goes to the direct exchange conveyor.tasks with the task's type as routing
// key and lands in the durable priority queue conveyor.task.<type>. Only
// workers declare those queues, for the types they run: a message for a
// type no worker has declared yet is returned to the relay, which parks it
// in PostgreSQL. task.cancel messages are broadcast on the fanout exchange
// conveyor.control to an exclusive queue per worker.
//
// Publisher, Consumer and Inspector speak in the types of package outbox.
// Two things of amqp091-go are visible to callers: DeclareExchanges and
// DeclareTaskQueue take an *amqp.Channel, for code that holds its own
// channel (tests, tools), and the errors returned by Err may wrap an
// *amqp.Error, which errors.As finds.
package rabbitmq

import (
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/conveyorhq/conveyor/internal/task"
)

// The names of the topology.
const (
	// TasksExchange routes task.run messages to their type's queue.
	TasksExchange = "conveyor.tasks"
	// ControlExchange broadcasts task.cancel messages to every worker.
	ControlExchange = "conveyor.control"
)

// QueueName is the durable queue that holds the task.run messages of a type.
func QueueName(taskType string) string { return "conveyor.task." + taskType }

// DeclareExchanges declares both exchanges, durable. Declaring is idempotent.
func DeclareExchanges(ch *amqp.Channel) error {
	if err := ch.ExchangeDeclare(TasksExchange, amqp.ExchangeDirect, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %s: %w", TasksExchange, err)
	}
	if err := ch.ExchangeDeclare(ControlExchange, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %s: %w", ControlExchange, err)
	}
	return nil
}

// DeclareTaskQueue declares a type's durable queue, whose x-max-priority is
// task.MaxPriority so that every priority a task may have is honoured, and
// binds it to the tasks exchange with the type as routing key. Workers
// declare the queues of their types before consuming; the relay never
// declares one, so the set of queues is the set of types some worker runs.
// Declaring is idempotent.
func DeclareTaskQueue(ch *amqp.Channel, taskType string) error {
	q := QueueName(taskType)
	if _, err := ch.QueueDeclare(q, true, false, false, false, amqp.Table{"x-max-priority": int32(task.MaxPriority)}); err != nil {
		return fmt.Errorf("declare queue %s: %w", q, err)
	}
	if err := ch.QueueBind(q, taskType, TasksExchange, false, nil); err != nil {
		return fmt.Errorf("bind queue %s: %w", q, err)
	}
	return nil
}
